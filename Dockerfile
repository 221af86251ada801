# One image for all three services; docker-compose.yml picks the module per container.
#
# BASE_IMAGE: any image with Python 3.11+ where `python` and `pip` are first on PATH. Where no
# registry is reachable, .ci/base-image makes one from Debian's packages.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app:/app/gen/python

WORKDIR /app

# Dependencies first, so code changes do not reinstall them. The kubernetes client (for the
# provisioner's kubernetes backend) is an optional extra elsewhere; the image carries it.
# A build host behind a TLS-inspecting proxy passes its CA bundle as the optional build secret
# `build_ca`: it is mounted for this step only and never written to a layer.
COPY requirements.txt requirements-kubernetes.txt ./
RUN --mount=type=secret,id=build_ca,required=false \
    if [ -s /run/secrets/build_ca ]; then export PIP_CERT=/run/secrets/build_ca; fi \
    && pip install -r requirements.txt -r requirements-kubernetes.txt

COPY gen/ gen/
COPY services/ services/
COPY examples/ examples/

# Run unprivileged; the state directories are volume mount points owned by that user.
RUN useradd --create-home --uid 10001 replicaplane \
    && mkdir -p .state/controller .state/provisioner .state/loadbalancer \
    && chown -R replicaplane .state
USER replicaplane

# The commit the image was built from, for replicaplane_build_info (there is no .git inside).
# Last, so a new commit rebuilds only this layer.
ARG GIT_COMMIT=""
ENV REPLICAPLANE_GIT_COMMIT=${GIT_COMMIT}

EXPOSE 50051 50052 50053
CMD ["python", "-m", "services.controller"]
