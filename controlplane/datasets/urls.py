"""Dataset routes under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.datasets.api import DatasetCompleteApi, DatasetDataApi, DatasetDetailApi, DatasetListCreateApi

urlpatterns = [
    re_path(r"^datasets/?$", DatasetListCreateApi.as_view(), name="dataset-list"),
    re_path(r"^datasets/(?P<dataset_id>[^/]+)/?$", DatasetDetailApi.as_view(), name="dataset-detail"),
    re_path(r"^datasets/(?P<dataset_id>[^/]+)/data/?$", DatasetDataApi.as_view(), name="dataset-data"),
    re_path(r"^datasets/(?P<dataset_id>[^/]+)/complete/?$", DatasetCompleteApi.as_view(), name="dataset-complete"),
]
