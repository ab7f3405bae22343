"""Dataset endpoints: open an upload, send its pieces (resumable), complete it, list, read, delete."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.common.body_limit import declared_length
from controlplane.common.schema import ErrorOutput
from controlplane.datasets.selectors import dataset_get_for_user, dataset_list_for_user
from controlplane.datasets.serializers import DatasetCreateInput, DatasetOutput, DatasetPartInput
from controlplane.datasets.services import dataset_complete, dataset_create, dataset_delete, dataset_part_receive

OFFSET = OpenApiParameter("offset", int, OpenApiParameter.QUERY, required=True,
                          description="where the piece starts: the dataset's uploaded_bytes")


class DatasetListCreateApi(APIView):
    @extend_schema(responses=DatasetOutput(many=True))
    def get(self, request: Request) -> Response:
        return Response(DatasetOutput(dataset_list_for_user(user=request.user), many=True).data)

    @extend_schema(request=DatasetCreateInput, responses={201: DatasetOutput})
    def post(self, request: Request) -> Response:
        """Open an upload: declare the file's format, size and SHA-256 (403 past your quotas)."""
        data = DatasetCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        dataset = dataset_create(owner=request.user, **data.validated_data)
        return Response(DatasetOutput(dataset).data, status=status.HTTP_201_CREATED)


class DatasetDetailApi(APIView):
    @extend_schema(responses=DatasetOutput)
    def get(self, request: Request, dataset_id: str) -> Response:
        return Response(DatasetOutput(dataset_get_for_user(user=request.user, dataset_id=dataset_id)).data)

    @extend_schema(responses={204: None, 409: ErrorOutput})
    def delete(self, request: Request, dataset_id: str) -> Response:
        dataset_delete(dataset=dataset_get_for_user(user=request.user, dataset_id=dataset_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


class DatasetDataApi(APIView):
    """A piece of the file, streamed into storage: it must start where the upload is (`offset`, else 409 with
    where it is); an interrupted upload resumes from the dataset's `uploaded_bytes`."""

    parser_classes: list = []  # the body is read as a stream, never parsed or held whole

    @staticmethod
    def max_request_bytes() -> int:  # not the JSON API's bound (controlplane.common.body_limit)
        return settings.ARCEUS_DATASET_MAX_CHUNK_BYTES

    @extend_schema(
        parameters=[OFFSET],
        request={"application/octet-stream": bytes},
        responses={200: DatasetOutput, 409: ErrorOutput, 413: ErrorOutput},
    )
    def put(self, request: Request, dataset_id: str) -> Response:
        dataset = dataset_get_for_user(user=request.user, dataset_id=dataset_id)
        query = DatasetPartInput(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        dataset = dataset_part_receive(
            dataset=dataset,
            offset=query.validated_data["offset"],
            body=request._request,
            length=declared_length(request),
        )
        return Response(DatasetOutput(dataset).data)


class DatasetCompleteApi(APIView):
    """Every byte has arrived: join the pieces, check the hash and the format. Ready (with its facts), or a 400
    naming what is wrong (the dataset is then failed and its files deleted)."""

    @extend_schema(request=None, responses={200: DatasetOutput, 409: ErrorOutput})
    def post(self, request: Request, dataset_id: str) -> Response:
        dataset = dataset_get_for_user(user=request.user, dataset_id=dataset_id)
        return Response(DatasetOutput(dataset_complete(dataset=dataset)).data)
