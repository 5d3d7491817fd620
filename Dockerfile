# One image for every pdserve service (router, prefill, decode, mixed); the command picks the role.
FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install --no-cache-dir .
ENTRYPOINT ["pdserve"]
CMD ["--help"]
