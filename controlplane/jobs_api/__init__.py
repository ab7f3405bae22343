"""The owner's job REST API under /api/ (views `api`, routes `urls`, bodies `serializers`): it acts through the
jobs services and shows a job's cost from the market, so it sits above both (no models of its own)."""
