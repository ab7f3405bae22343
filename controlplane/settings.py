"""Django settings, driven by environment variables (defaults suit a single-machine demo).

DATABASE_URL     default: SQLite file var/arceus.sqlite3 under the repository
REDIS_URL        Celery broker and result backend (default redis://127.0.0.1:6379/0)
ARCEUS_ALLOWED_HOSTS (or ALLOWED_HOSTS)  comma-separated (default localhost,127.0.0.1)
ARCEUS_SECRET_KEY, ARCEUS_DEBUG, and the other ARCEUS_* below
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


# Everything the control plane signs or mints (sessions, the data plane's credentials) is under this key. The
# development key is public (it is in this file): the web server and the Celery processes refuse to start with
# it unless ARCEUS_DEBUG is set (controlplane.common.startup); management commands and tests may use it.
DEVELOPMENT_SECRET_KEY = "dev-only-arceus-7c1f0e9a4b2d8c6e3f5a1b9d7e2c4a6f8b0d3e5c7a9f1b2d4e6c8a0f"
SECRET_KEY = os.environ.get("ARCEUS_SECRET_KEY", DEVELOPMENT_SECRET_KEY)
DEBUG = _env_bool("ARCEUS_DEBUG", False)
ALLOWED_HOSTS = _env_list(
    "ARCEUS_ALLOWED_HOSTS" if "ARCEUS_ALLOWED_HOSTS" in os.environ else "ALLOWED_HOSTS", "localhost,127.0.0.1"
)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's JS and CSS, served as our own static files (no CDN)
    "controlplane.common",
    "controlplane.accounts",
    "controlplane.nodes",
    "controlplane.jobs",
    "controlplane.datasets",
    "controlplane.market",
    "controlplane.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # The collected static files (the admin's, Swagger UI's), from STATIC_ROOT, before any other work.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "controlplane.common.body_limit.RequestBodyLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
# The dashboard's pages send a visitor who is not logged in to its login page (Django's auth, the same users).
LOGIN_URL = "dashboard-login"
LOGIN_REDIRECT_URL = "dashboard-jobs"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{VAR_DIR / 'arceus.sqlite3'}",
        # The web server sets it (60): a heartbeat must not open a connection of its own. Health checks make a
        # kept connection that a database restart broke reconnect at the next request's start.
        conn_max_age=int(os.environ.get("ARCEUS_DB_CONN_MAX_AGE", "0")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["ENGINE"] = "controlplane.common.postgresql"  # its health check needs no round trip
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The demo runs web, Celery worker and beat on one SQLite file: WAL lets readers run beside the one
    # writer, IMMEDIATE takes the write lock when a transaction begins (no upgrade deadlocks), and the
    # timeout makes a busy writer wait instead of failing with "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    if DATABASES["default"]["NAME"] not in ("", ":memory:"):
        Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Request bodies: the JSON API takes at most this (a 413 naming the bound, controlplane.common.body_limit;
# the agents' checkpoint uploads have their own, ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES); Django's own form and
# body parsing (the admin) the same.
ARCEUS_MAX_REQUEST_BYTES = int(os.environ.get("ARCEUS_MAX_REQUEST_BYTES", str(1 << 20)))
DATA_UPLOAD_MAX_MEMORY_SIZE = ARCEUS_MAX_REQUEST_BYTES

# Cookies and headers for a control plane served over TLS (outside development): cookies only over HTTPS and
# out of scripts' reach, no MIME sniffing, no framing. Behind a proxy that terminates TLS, set
# ARCEUS_PROXY_SSL_HEADER=1 only if the proxy sets X-Forwarded-Proto itself (else a client could claim HTTPS).
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = not DEBUG
if _env_bool("ARCEUS_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
# Where every client reaches the control plane over HTTPS (agents included): redirect plain HTTP, and HSTS
# (browsers then refuse HTTP for that long: irreversible, hence opt-in).
SECURE_SSL_REDIRECT = _env_bool("ARCEUS_SSL_REDIRECT", False)
SECURE_HSTS_SECONDS = int(os.environ.get("ARCEUS_HSTS_SECONDS", "0"))

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Static files (the admin's and Swagger UI's CSS and JS): `manage.py collectstatic` copies them into STATIC_ROOT
# with content-hashed, compressed copies, and WhiteNoise serves them from there with far-future cache headers.
# Pages name files by their hash, so a page rendered before collectstatic ran fails (run it at every deploy).
STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("ARCEUS_STATIC_ROOT", VAR_DIR / "static"))
# Files served at the site's root (browsers ask every site for /favicon.ico).
WHITENOISE_ROOT = BASE_DIR / "controlplane" / "common" / "root"
MEDIA_ROOT = Path(os.environ.get("ARCEUS_MEDIA_ROOT", VAR_DIR / "media"))
MEDIA_URL = "media/"


def checkpoint_storage_settings(env: Mapping[str, str]) -> dict[str, object]:
    """Checkpoints go through Django's storage API: files under ARCEUS_CHECKPOINT_DIR by default, or
    the S3-compatible bucket ARCEUS_CHECKPOINT_S3_BUCKET (django-storages; endpoint and credentials
    from AWS_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_S3_REGION_NAME)."""
    bucket = env.get("ARCEUS_CHECKPOINT_S3_BUCKET", "")
    if bucket:
        return {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": env.get("AWS_S3_ENDPOINT_URL") or None,
                "access_key": env.get("AWS_ACCESS_KEY_ID") or None,
                "secret_key": env.get("AWS_SECRET_ACCESS_KEY") or None,
                "region_name": env.get("AWS_S3_REGION_NAME") or None,
                "file_overwrite": False,
                # SigV4: a presigned ranged GET (a stage's dataset read) binds its Range header.
                "signature_version": "s3v4",
                # A file opened for reading spools to disk past 8 MiB, never whole in memory.
                "max_memory_size": 8 << 20,
            },
        }
    return {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": env.get("ARCEUS_CHECKPOINT_DIR", str(VAR_DIR / "checkpoints"))},
    }


STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    "checkpoints": checkpoint_storage_settings(os.environ),
    # Uploaded datasets (controlplane.datasets) share the checkpoints' place, under datasets/.
    "datasets": checkpoint_storage_settings(os.environ),
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        "controlplane.common.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "controlplane.common.schema.ArceusAutoSchema",
    "EXCEPTION_HANDLER": "controlplane.common.exception_handler.exception_handler",
    # Rates of the endpoints a stranger or a runaway script could make expensive (views name their scope:
    # DRF's ScopedRateThrottle; login and sign-up by client address, the rest by user; password changes count
    # as logins). ARCEUS_THROTTLE_<SCOPE> overrides (ARCEUS_THROTTLE_REGISTER: sign-ups per address).
    "DEFAULT_THROTTLE_RATES": {
        scope: os.environ.get(f"ARCEUS_THROTTLE_{scope.upper()}", rate)
        for scope, rate in {
            "login": "10/min",
            "register": "20/hour",
            "estimate": "30/min",
            "sample": "30/min",
            "model": "30/hour",
            "node_create": "30/hour",
            # An agent registers once per start; these allow a fleet's restart, not a script's flood.
            "agent_register_owner": "30/min",
            "agent_register_address": "60/min",
        }.items()
    },
}
# Throttle counts live in this cache: per process by default; ARCEUS_CACHE_URL (redis://...) shares them
# between the web server's processes.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": os.environ["ARCEUS_CACHE_URL"]}
    if "ARCEUS_CACHE_URL" in os.environ
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Arceus control plane API",
    "DESCRIPTION": (
        "Submit training jobs, contribute nodes, and the node-agent protocol. Errors are "
        '{"detail": "...", "errors": {"<field>": ["..."]}} (errors only for invalid input).'
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # /api/docs loads Swagger UI from our static files (drf-spectacular-sidecar), not from a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Arceus ---------------------------------------------------------------------------------------
# How many reverse proxies that append X-Forwarded-For stand in front of the web server (deploy/compose.yaml's nginx:
# 1): the client's address is the entry the outermost one appended (controlplane/common/client_ip.py). 0: REMOTE_ADDR.
ARCEUS_TRUSTED_PROXIES = int(os.environ.get("ARCEUS_TRUSTED_PROXIES", "0"))
# Relays (`python -m arceus.relay`) for agents the control plane cannot dial back: their HOST:PORTs, comma
# separated, as agents and callers reach them; and the secret they share with the control plane (tickets).
ARCEUS_RELAYS = [r.strip() for r in os.environ.get("ARCEUS_RELAYS", "").split(",") if r.strip()]
ARCEUS_RELAY_SECRET = os.environ.get("ARCEUS_RELAY_SECRET", "")
# The relays' TLS certificate (PEM file; `python -m arceus.relay --new-identity` made it with their key): agents and
# callers pin it, handed out with the relays.
ARCEUS_RELAY_CERTIFICATE_FILE = os.environ.get("ARCEUS_RELAY_CERTIFICATE_FILE", "")
ARCEUS_RELAY_TICKET_SECONDS = float(os.environ.get("ARCEUS_RELAY_TICKET_SECONDS", "3600"))
# How long the dial-back after a registration waits for the agent's health check.
ARCEUS_REACHABILITY_TIMEOUT_SECONDS = float(os.environ.get("ARCEUS_REACHABILITY_TIMEOUT_SECONDS", "3"))
# Dial-backs run on their own queue and worker (`-Q reachability`), in sweeps of up to BATCH nodes dialled
# CONCURRENCY at a time; a sweep also runs every SWEEP_SECONDS for any node whose check was lost.
ARCEUS_REACHABILITY_CONCURRENCY = int(os.environ.get("ARCEUS_REACHABILITY_CONCURRENCY", "256"))
ARCEUS_REACHABILITY_BATCH = int(os.environ.get("ARCEUS_REACHABILITY_BATCH", "2000"))
ARCEUS_REACHABILITY_SWEEP_SECONDS = float(os.environ.get("ARCEUS_REACHABILITY_SWEEP_SECONDS", "60"))
# How often agents heartbeat (told to them in every response).
ARCEUS_HEARTBEAT_INTERVAL_SECONDS = float(os.environ.get("ARCEUS_HEARTBEAT_INTERVAL_SECONDS", "2"))
# A node whose last heartbeat is older than this is marked Ready=Unknown (its lease duration).
ARCEUS_NODE_GRACE_SECONDS = float(os.environ.get("ARCEUS_NODE_GRACE_SECONDS", "6"))
# Placement trusts a node's measured links to its pipeline neighbours for this long (agents re-measure
# every 5 minutes while they have neighbours); older figures give way to its control-plane link.
ARCEUS_NEIGHBOUR_LINK_MAX_AGE_SECONDS = float(os.environ.get("ARCEUS_NEIGHBOUR_LINK_MAX_AGE_SECONDS", "1800"))
# The periodic full resync (Celery beat); changes also nudge the reconciler at once.
ARCEUS_RECONCILE_INTERVAL_SECONDS = float(os.environ.get("ARCEUS_RECONCILE_INTERVAL_SECONDS", "2"))
# A training driver renews its lease from a thread every third of this; a driver silent for longer is
# dead, and the reconciler rewinds its job to the last checkpoint and starts another. It also bounds how
# long a started but not yet picked-up driver task may wait before the reconciler enqueues another.
ARCEUS_DRIVER_LEASE_SECONDS = float(os.environ.get("ARCEUS_DRIVER_LEASE_SECONDS", "10"))
ARCEUS_RPC_TIMEOUT_SECONDS = float(os.environ.get("ARCEUS_RPC_TIMEOUT_SECONDS", "60"))
# How long a sampling request waits for the training worker that samples through the agents (503 after).
ARCEUS_SAMPLE_TIMEOUT_SECONDS = float(os.environ.get("ARCEUS_SAMPLE_TIMEOUT_SECONDS", "120"))
# The largest stage state file (weights, optimizer state and buffers) an agent may upload for a checkpoint.
ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES = int(os.environ.get("ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES", str(64 << 30)))
# With an S3 bucket, agents send that file straight there in parts of this size (S3's least is 5 MiB): each part
# is an agent's buffer, and what an interrupted upload resends at most.
ARCEUS_CHECKPOINT_PART_BYTES = int(os.environ.get("ARCEUS_CHECKPOINT_PART_BYTES", str(64 << 20)))
if ARCEUS_CHECKPOINT_PART_BYTES < 5 << 20:
    raise ImproperlyConfigured(f"ARCEUS_CHECKPOINT_PART_BYTES is {ARCEUS_CHECKPOINT_PART_BYTES}: S3 parts are >= 5 MiB")
# A job whose driver or stages fail this many times without a lost node to explain it fails for good.
# Uploaded datasets: per tenant at most this many bytes and datasets (those whose upload failed not counted),
# each sent in pieces of at most ARCEUS_DATASET_MAX_CHUNK_BYTES (a request the web server streams to storage).
ARCEUS_DATASET_QUOTA_BYTES = int(os.environ.get("ARCEUS_DATASET_QUOTA_BYTES", str(20 << 30)))
ARCEUS_DATASET_QUOTA_COUNT = int(os.environ.get("ARCEUS_DATASET_QUOTA_COUNT", "100"))
ARCEUS_DATASET_MAX_CHUNK_BYTES = int(os.environ.get("ARCEUS_DATASET_MAX_CHUNK_BYTES", str(64 << 20)))
ARCEUS_JOB_MAX_RESTARTS = int(os.environ.get("ARCEUS_JOB_MAX_RESTARTS", "5"))
# How long a running job takes to checkpoint and stop once asked (a reconcile pass, the driver's next write, the
# step in progress, the checkpoint's upload): a job with a max_total_usd is asked that long before its charges
# would reach it.
ARCEUS_JOB_STOP_SECONDS = float(os.environ.get("ARCEUS_JOB_STOP_SECONDS", "30"))
# A node whose agent registers again while hosting a stage (each time its job rewinds and replays the lost
# steps) more than this many times within the window is flagged: it gets no new stage until an operator clears it.
ARCEUS_NODE_MAX_RESTARTS = int(os.environ.get("ARCEUS_NODE_MAX_RESTARTS", "3"))
ARCEUS_NODE_RESTART_WINDOW_SECONDS = float(os.environ.get("ARCEUS_NODE_RESTART_WINDOW_SECONDS", "3600"))
# A replica the training driver fenced this many times (failed steps between live replicas, each fence keeping it
# out twice as long) within a window of this many train steps is dropped, its stage keeping a live replica, and its
# node takes no replica of the job for ARCEUS_REPLICA_FENCED_OUT_SECONDS: a link or host that keeps failing wastes
# the slot, and another Ready node may take it.
ARCEUS_REPLICA_MAX_FENCES = int(os.environ.get("ARCEUS_REPLICA_MAX_FENCES", "3"))
ARCEUS_REPLICA_FENCE_WINDOW_STEPS = int(os.environ.get("ARCEUS_REPLICA_FENCE_WINDOW_STEPS", "100"))
ARCEUS_REPLICA_FENCED_OUT_SECONDS = float(os.environ.get("ARCEUS_REPLICA_FENCED_OUT_SECONDS", "600"))
# The largest model a job may submit: pipeline layers (the placement solver's time grows with their square) and
# parameters.
ARCEUS_MAX_MODEL_LAYERS = int(os.environ.get("ARCEUS_MAX_MODEL_LAYERS", "128"))
ARCEUS_MAX_MODEL_PARAMETERS = int(os.environ.get("ARCEUS_MAX_MODEL_PARAMETERS", str(20 * 10**9)))
# Tenants' dataset files (a text dataset's `source`, MNIST's `path`) are named relative to this directory and
# confined to it (arceus.data.paths); the bundled datasets need nothing here.
ARCEUS_DATA_ROOT = Path(os.environ.get("ARCEUS_DATA_ROOT", BASE_DIR / "data"))
# The placement solver's time per search (an estimate; each queued job in a reconcile pass): past it, the best
# placement over the fastest nodes found so far, or "ran out" when none was.
ARCEUS_SOLVER_SECONDS = float(os.environ.get("ARCEUS_SOLVER_SECONDS", "3"))
# Queued jobs one reconcile pass places (oldest first; the rest wait for the next pass): with 10,000 nodes a
# placement search costs tens of ms, and a pass must stay short enough to notice silent nodes in time (why 10:
# docs/BENCHMARKS.md, "The training fleet").
ARCEUS_MAX_PLACEMENTS_PER_PASS = int(os.environ.get("ARCEUS_MAX_PLACEMENTS_PER_PASS", "10"))
# The guard against a cascade of rewinds (controlplane/controller/moves.py; docs/BENCHMARKS.md, "The collapse at
# f343d2a"). Jobs one pass rewinds to move lost stages (oldest first; the rest wait for the next pass): each rewind
# cost ~0.3 s on a loaded machine, so 10 keep a pass's rewinds near the seconds its placements take (why 10 for
# those: above); a stage moved off a paused node and a replica dropped are not counted. No lost stage moves while
# more than this share of the nodes hosting stages are silent at once (Kubernetes' --unhealthy-zone-threshold;
# 1.0: never), and at least ARCEUS_DISRUPTION_MIN_NODES of them: fewer lost nodes host at most that many jobs
# (one active job a node), which the cap moves in one pass, so a small cluster losing most of its nodes moves them.
ARCEUS_MAX_MOVES_PER_PASS = int(os.environ.get("ARCEUS_MAX_MOVES_PER_PASS", "10"))
ARCEUS_DISRUPTION_THRESHOLD = float(os.environ.get("ARCEUS_DISRUPTION_THRESHOLD", "0.55"))
ARCEUS_DISRUPTION_MIN_NODES = int(os.environ.get("ARCEUS_DISRUPTION_MIN_NODES", "10"))
# The market: a standard-medium device (a typical laptop) earns about this per hour when demand and
# supply balance; the platform keeps this fraction of every charge; prices are recomputed this often.
ARCEUS_BASELINE_PRICE_PER_HOUR = float(os.environ.get("ARCEUS_BASELINE_PRICE_PER_HOUR", "0.30"))
ARCEUS_PLATFORM_FEE = float(os.environ.get("ARCEUS_PLATFORM_FEE", "0.10"))
# A spot-checked forward must match its recomputation on another node within these (torch.allclose).
ARCEUS_AUDIT_RTOL = float(os.environ.get("ARCEUS_AUDIT_RTOL", "1e-4"))
ARCEUS_AUDIT_ATOL = float(os.environ.get("ARCEUS_AUDIT_ATOL", "1e-5"))
ARCEUS_REPRICE_INTERVAL_SECONDS = float(os.environ.get("ARCEUS_REPRICE_INTERVAL_SECONDS", "30"))
ARCEUS_LEDGER_ROLLUP_INTERVAL_SECONDS = float(os.environ.get("ARCEUS_LEDGER_ROLLUP_INTERVAL_SECONDS", "300"))
# The job detail thins its loss curve to at most this many points.
ARCEUS_LOSS_CURVE_MAX_POINTS = int(os.environ.get("ARCEUS_LOSS_CURVE_MAX_POINTS", "1000"))
# The bearer token Prometheus sends to GET /metrics and GET /metrics/agents (controlplane/monitoring/views.py);
# unset, both refuse every caller. At least 32 characters: python -c 'import secrets; print(secrets.token_urlsafe())'.
ARCEUS_METRICS_TOKEN = os.environ.get("ARCEUS_METRICS_TOKEN", "")
if 0 < len(ARCEUS_METRICS_TOKEN) < 32:
    raise ImproperlyConfigured(
        f"ARCEUS_METRICS_TOKEN has {len(ARCEUS_METRICS_TOKEN)} characters; use at least 32 random ones (for example "
        "the output of python -c 'import secrets; print(secrets.token_urlsafe())')"
    )

# --- Celery (read by controlplane/celery.py with namespace CELERY) ---------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TIMEZONE = TIME_ZONE

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        name: {
            "handlers": ["console"],
            "level": os.environ.get("ARCEUS_LOG_LEVEL", "INFO"),
            "propagate": False,
        }
        for name in ("arceus", "controlplane", "tasks")
    },
}
