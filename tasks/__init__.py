"""Celery task modules: each task is thin, takes ids, and calls one control-plane function. The app is
`controlplane.celery` (`celery -A controlplane.celery worker -Q control`)."""
