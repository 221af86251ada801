# One image for all three services; docker-compose.yml picks the module per container.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app:/app/gen/python

WORKDIR /app

# Dependencies first, so code changes do not reinstall them. The kubernetes client (for the
# provisioner's kubernetes backend) is an optional extra elsewhere; the image carries it.
COPY requirements.txt requirements-kubernetes.txt ./
RUN pip install -r requirements.txt -r requirements-kubernetes.txt

COPY gen/ gen/
COPY services/ services/
COPY examples/ examples/

# Run unprivileged; the state directories are volume mount points owned by that user.
RUN useradd --create-home --uid 10001 replicaplane \
    && mkdir -p .state/controller .state/provisioner \
    && chown -R replicaplane .state
USER replicaplane

EXPOSE 50051 50052 50053
CMD ["python", "-m", "services.controller"]
