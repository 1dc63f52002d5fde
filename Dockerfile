# lora-serve on CPU. Serves the embedded demo model (and its adapters) by default, with tracing on and adapter
# management off (reachable from the network, LoadAdapter / UnloadAdapter would need a token: see below).
#
#   docker build -t lora-serve .
#   docker run --stop-timeout 45 -p 50051:50051 -p 8000:8000 -v lora-serve-cache:/cache lora-serve
#   docker run --stop-timeout 45 -p 50051:50051 -v lora-serve-cache:/cache \
#       -e LORA_SERVE_ADMIN_TOKEN="${LORA_SERVE_ADMIN_TOKEN:?set it to a secret first}" \
#       -v "$PWD/models:/models:ro" -v "$PWD/adapters:/adapters:ro" lora-serve lora-serve --host 0.0.0.0 \
#       --tracing --grace-period 30 --model /models/Llama-3.2-1B --adapter sql=/adapters/sql
#
# --stop-timeout: SIGTERM drains for --grace-period (30 s) plus at most 5 s of telemetry flush; Docker's default
# of 10 s would SIGKILL the drain. The admin token goes in the environment, never on argv (ps shows argv).
# /models and /adapters: mount your Hugging Face model and PEFT adapter directories (read-only is fine).
# /cache: the demo model and the Inductor cache; keep it in a volume and a restart skips compilation.
# Tracing: OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_* variables (docs/tracing.md; docker-compose.yml).
FROM python:3.11-slim

# torch.compile's CPU backend (Inductor) compiles C++ kernels at warm-up: it needs a compiler. TCMalloc: the
# server preloads it when present (service/allocator.py; faster CPU decode steps than glibc's malloc).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LORA_SERVE_CACHE=/cache

# torch first, in a layer of its own (large, rarely changes), at the version pyproject.toml pins. The CPU
# index keeps CUDA wheels out of the image; --build-arg TORCH_INDEX_URL=https://pypi.org/simple for PyPI's build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY . .
RUN pip install ".[server]" \
    && useradd --create-home --uid 1000 lora \
    && mkdir -p /cache /models /adapters \
    && chown lora /cache

USER lora
VOLUME ["/cache"]
EXPOSE 50051
EXPOSE 8000
CMD ["lora-serve", "--host", "0.0.0.0", "--tracing", "--grace-period", "30", "--disable-adapter-management"]
