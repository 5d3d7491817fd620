# One image for every pdserve service (router, prefill, decode, mixed); the command picks the role.
FROM python:3.11-slim
# libgomp1: Paddle's OpenMP runtime (`import paddle` fails without it on the slim image);
# libibverbs1, libnuma1, libcurl4: what the Mooncake wheel's engine.so links against.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libibverbs1 libnuma1 libcurl4 \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install --no-cache-dir '.[mooncake]'
ENTRYPOINT ["pdserve"]
CMD ["--help"]
