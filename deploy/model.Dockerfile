# The edge model as its own layer on top of the gateway image (deploy/Dockerfile), so that changing
# the model rebuilds this one layer and never the gateway's: `make image EDGE_CONFIG=FILE` pulls the
# GGUF that FILE's edge.model names (`tierlane edge pull`, verified against edge.model_sha256) and
# builds this with the pulled file's folder as the context. By hand:
#   tierlane edge pull --config pull.yaml          # prints the path and sha256
#   docker build -f deploy/model.Dockerfile --build-arg GATEWAY_IMAGE=tierlane:0.1.0 \
#     --build-arg MODEL_FILE=<file name> --build-arg MODEL_SHA256=<sha256> -t tierlane:0.1.0-edge <folder of the file>
# The image names the model and its digest in its environment; the gateway checks the digest at
# start (its first start hashes the file once; the digest is then remembered, here at build time).
ARG GATEWAY_IMAGE=tierlane:0.1.0
FROM ${GATEWAY_IMAGE}
ARG MODEL_FILE
ARG MODEL_SHA256
COPY ${MODEL_FILE} /opt/tierlane/edge-model/${MODEL_FILE}
ENV TIERLANE_EDGE_MODEL=/opt/tierlane/edge-model/${MODEL_FILE} TIERLANE_EDGE_MODEL_SHA256=${MODEL_SHA256}
# Verifies the file against its pin now (a wrong file fails the build) and remembers its digest.
RUN tierlane edge pull >/dev/null
