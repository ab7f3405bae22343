"""Job endpoints: submit, list, detail, train (start), cancel, the trained model, serving it, and text sampled from
it."""

from __future__ import annotations

from types import SimpleNamespace

from django.conf import settings
from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from arceus.model.exported.program import MAX_PROGRAM_BYTES
from controlplane.common.body_limit import declared_length
from controlplane.common.db import consistent_snapshot
from controlplane.common.schema import ErrorOutput
from controlplane.jobs.checkpoints import MODEL_FORMATS, job_initial_weights_receive, job_model_file
from controlplane.jobs.estimate import estimate_get_for_user, estimate_request
from controlplane.jobs.programs import job_program_receive
from controlplane.jobs.sampling import job_sample
from controlplane.jobs.selectors import job_get_for_user, job_list_for_user
from controlplane.jobs.services import job_cancel, job_initialize, job_start, job_submit, job_train
from controlplane.jobs.serving import job_serve
from controlplane.jobs_api.serializers import (
    EstimateStatusOutput,
    JobDetailOutput,
    JobListOutput,
    JobSampleInput,
    JobSampleOutput,
    JobServeInput,
    JobStartInput,
    JobSubmitInput,
)

JOB_ID = OpenApiParameter("job_id", str, OpenApiParameter.PATH, description="Job UUID")
ESTIMATE_ID = OpenApiParameter("estimate_id", str, OpenApiParameter.PATH, description="Estimate UUID")


class JobListCreateApi(APIView):
    @extend_schema(responses=JobListOutput(many=True))
    def get(self, request: Request) -> Response:
        return Response(JobListOutput(job_list_for_user(user=request.user), many=True).data)

    @extend_schema(request=JobSubmitInput, responses={201: JobDetailOutput})
    def post(self, request: Request) -> Response:
        data = JobSubmitInput(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_submit(owner=request.user, **data.validated_data)
        return Response(JobDetailOutput(job).data, status=status.HTTP_201_CREATED)


class JobEstimateApi(APIView):
    """What a job would get if submitted now: placement, expected speed and hours, price. Saves no job. The job
    is checked here (400s as for a submission); a worker computes the rest: 202 with the estimate's URL to poll."""

    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "estimate"  # each one runs the placement solver on a worker

    @extend_schema(request=JobSubmitInput, responses={202: EstimateStatusOutput})
    def post(self, request: Request) -> Response:
        data = JobSubmitInput(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        estimate = estimate_request(
            owner=request.user,
            model_config=v["model_config"],
            dataset_config=v["dataset_config"],
            epochs=v["epochs"],
            micro_batches=v["micro_batches"],
            schedule=v["schedule"],
            staleness=v["staleness"],
            stages=v["stages"],
            requirements_config=v["requirements"],
            tensor_parallel=v["tensor_parallel"],
            optimizer=v["optimizer"],
            momentum=v["momentum"],
            precision=v["precision"],
            activation_checkpointing=v["activation_checkpointing"],
            replicas=v["replicas"],
            replica_sync=v["replica_sync"],
        )
        body = EstimateStatusOutput(estimate, context={"request": request}).data
        return Response(body, status=status.HTTP_202_ACCEPTED, headers={"Location": body["url"]})


class JobEstimateDetailApi(APIView):
    """An estimate: pending until a worker has computed it, then done (with the result) or failed (with why)."""

    @extend_schema(parameters=[ESTIMATE_ID], responses=EstimateStatusOutput)
    def get(self, request: Request, estimate_id: str) -> Response:
        estimate = estimate_get_for_user(user=request.user, estimate_id=estimate_id)
        return Response(EstimateStatusOutput(estimate, context={"request": request}).data)


class JobDetailApi(APIView):
    @extend_schema(parameters=[JOB_ID], responses=JobDetailOutput)
    def get(self, request: Request, job_id: str) -> Response:
        with consistent_snapshot():  # the job, its placements and its checkpoints as of one moment
            return Response(JobDetailOutput(job_get_for_user(user=request.user, job_id=job_id)).data)


class JobTrainApi(APIView):
    """Start (or restart) training: the job is queued and placed on nodes as they are available."""

    @extend_schema(parameters=[JOB_ID], request=JobStartInput, responses={202: JobDetailOutput, 409: ErrorOutput})
    def post(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        data = JobStartInput(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_start(job=job, **data.validated_data)
        return Response(JobDetailOutput(job).data, status=status.HTTP_202_ACCEPTED)


class NetworkInitializeApi(APIView):
    """The prototype's "initialize the devices with the model's layers": the job is queued and its stages placed
    on Ready nodes as they are available (its conditions say what it waits for); it trains once every stage's
    agent is ready. Until then POST /api/network/train/<job> may set its epochs and learning rate."""

    @extend_schema(parameters=[JOB_ID], request=None, responses={202: JobDetailOutput, 409: ErrorOutput})
    def post(self, request: Request, job_id: str) -> Response:
        job = job_initialize(job=job_get_for_user(user=request.user, job_id=job_id))
        return Response(JobDetailOutput(job).data, status=status.HTTP_202_ACCEPTED)


class NetworkTrainApi(APIView):
    """The prototype's "train": starts a job (as POST /api/jobs/<job>/train), or sets the epochs and learning
    rate of one that initialize queued and that has not begun training."""

    @extend_schema(parameters=[JOB_ID], request=JobStartInput, responses={202: JobDetailOutput, 409: ErrorOutput})
    def post(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        data = JobStartInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(JobDetailOutput(job_train(job=job, **data.validated_data)).data, status=202)


class JobCancelApi(APIView):
    @extend_schema(parameters=[JOB_ID], request=None, responses={200: JobDetailOutput, 409: ErrorOutput})
    def post(self, request: Request, job_id: str) -> Response:
        job = job_cancel(job=job_get_for_user(user=request.user, job_id=job_id))
        return Response(JobDetailOutput(job).data)


MODEL_FORMAT = OpenApiParameter(
    "format", str, OpenApiParameter.QUERY, enum=list(MODEL_FORMATS), default="safetensors",
    description="safetensors: one file of our parameter names; hf (a llama or a transformer): the tar of a Hugging "
    "Face folder (config.json, model.safetensors, the job's uploaded tokenizer.json) that transformers' "
    "from_pretrained loads",
)


class _FormatIsNoRenderer(DefaultContentNegotiation):
    """`?format=` names the model's file format here, not (as DRF's URL_FORMAT_OVERRIDE) a renderer."""

    settings = SimpleNamespace(URL_FORMAT_OVERRIDE=None)


class JobModelApi(APIView):
    """The trained model: every stage's weights from the newest checkpoint, as one safetensors file (or a
    Hugging Face folder's tar) streamed from the stages' checkpoint files."""

    content_negotiation_class = _FormatIsNoRenderer
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "model"  # a whole model read from storage

    @extend_schema(
        parameters=[JOB_ID, MODEL_FORMAT],
        responses={
            (200, "application/octet-stream"): bytes,
            (200, "application/x-tar"): bytes,
            400: ErrorOutput,  # a format the job's model has not
            409: ErrorOutput,
        },
    )
    def get(self, request: Request, job_id: str) -> StreamingHttpResponse:
        model_format = request.query_params.get("format", "safetensors")
        model = job_model_file(job=job_get_for_user(user=request.user, job_id=job_id), model_format=model_format)
        content_type = "application/x-tar" if model_format == "hf" else "application/octet-stream"
        response = StreamingHttpResponse(model.chunks, content_type=content_type)
        response["Content-Length"] = str(model.size_bytes)
        response["Content-Disposition"] = f'attachment; filename="{model.filename}"'
        return response


class JobInitialWeightsApi(APIView):
    """The weights a job starts from (fine-tuning): a Hugging Face `model.safetensors` of the job's model (a
    llama: every `LlamaForCausalLM` parameter, a transformer: every `GPT2LMHeadModel` one; float32, bfloat16 or
    float16), uploaded with a Content-Length before the job trains
    and streamed into storage; checked from its header before it is kept."""

    parser_classes: list = []  # the body is read as a stream, never parsed or held whole
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "model"  # a whole model written to storage

    @staticmethod
    def max_request_bytes() -> int:  # not the JSON API's bound (controlplane.common.body_limit)
        return settings.ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES

    # The job id is left to the derived path parameter: its pattern is what a negative fuzz case can break
    # (the binary body has nothing to make invalid).
    @extend_schema(request={"application/octet-stream": bytes}, responses={200: JobDetailOutput, 409: ErrorOutput})
    def put(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        job = job_initial_weights_receive(
            job=job, body=request._request, length=declared_length(request)
        )
        return Response(JobDetailOutput(job_get_for_user(user=request.user, job_id=str(job.id))).data)


class JobProgramApi(APIView):
    """An exported model's program (what `arceus.model.exported.capture` writes): its layers' graphs as JSON,
    uploaded with a Content-Length before the job trains, streamed into storage and checked (its hash and each
    layer's against the model config, every operator against the agents' allow-list) before it is kept."""

    parser_classes: list = []  # the body is read as a stream, never parsed by DRF
    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "model"

    @staticmethod
    def max_request_bytes() -> int:  # not the JSON API's bound (controlplane.common.body_limit)
        return MAX_PROGRAM_BYTES

    @extend_schema(request={"application/octet-stream": bytes}, responses={200: JobDetailOutput, 409: ErrorOutput})
    def put(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        job = job_program_receive(
            job=job, body=request._request, length=declared_length(request)
        )
        return Response(JobDetailOutput(job_get_for_user(user=request.user, job_id=str(job.id))).data)


class JobServeApi(APIView):
    """Serve a succeeded text job for sampling (POST; `{"serving": false}` stops it), or stop serving it (DELETE):
    its stages are placed on agents for inference from its final checkpoint, and released when it stops. Its
    Serving condition says when it is ready to sample."""

    @extend_schema(parameters=[JOB_ID], request=JobServeInput, responses={202: JobDetailOutput, 409: ErrorOutput})
    def post(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        data = JobServeInput(data=request.data)
        data.is_valid(raise_exception=True)
        job = job_serve(job=job, serving=data.validated_data["serving"])
        return Response(JobDetailOutput(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[JOB_ID], request=None, responses={202: JobDetailOutput})
    def delete(self, request: Request, job_id: str) -> Response:
        job = job_serve(job=job_get_for_user(user=request.user, job_id=job_id), serving=False)
        return Response(JobDetailOutput(job).data, status=status.HTTP_202_ACCEPTED)


class JobSampleApi(APIView):
    """Text continuing `prompt`, sampled through the agents that hold a running or served text job's stages."""

    throttle_classes = [ScopedRateThrottle]
    throttle_scope = "sample"  # every stage's agent decodes for it

    @extend_schema(
        parameters=[JOB_ID],
        request=JobSampleInput,
        responses={200: JobSampleOutput, 409: ErrorOutput, 503: ErrorOutput},  # 503: an agent failed; retry
    )
    def post(self, request: Request, job_id: str) -> Response:
        job = job_get_for_user(user=request.user, job_id=job_id)
        data = JobSampleInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(JobSampleOutput(job_sample(job=job, **data.validated_data)).data)
