#!/usr/bin/env bash
# Build the deployment images from the repository root; the tags here are the ones deploy/k8s and
# deploy/compose refer to (retag and push them to your registry, see docs/deploy.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
docker build -f deploy/docker/Dockerfile.cpu -t hloserve/server-cpu:0.1.0 .
docker build -f deploy/docker/Dockerfile.tpu -t hloserve/server-tpu:0.1.0 .
docker build -f deploy/docker/Dockerfile.tf-serving -t hloserve/tf-serving:0.1.0 .
