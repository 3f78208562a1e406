# kvd container image: multi-stage on Debian 12.
#
#   docker build -t kvd .                      # portable x86-64-v2 build
#   docker build --build-arg ARCH=native -t kvd .
#   docker run -p 8080:8080 -v $PWD/models:/models:ro kvd \
#       --config /etc/kvd/kvd.conf --set model.path=/models/your.gguf
#
# Without a mounted model the image serves the small seeded default model
# generated at build time, so `docker run -p 8080:8080 kvd` answers at once.

FROM debian:12 AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      gcc libc6-dev make pkg-config libuv1-dev libjansson-dev node-llhttp \
      libinih-dev libpcre2-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# A portable instruction set by default: the image may run on other CPUs.
# The SIMD kernels are built for every level regardless and chosen at start
# (the log's start line and /health say which), so this costs them nothing.
ARG ARCH=x86-64-v2
RUN make ARCH=${ARCH} kvd \
 && mkdir -p /out \
 && cp build/kvd /out/kvd \
 && ./build/kvd mkmodel --preset retrieval --out /out/default.gguf

FROM debian:12-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libuv1 libjansson4 libinih1 libpcre2-8-0 libgomp1 curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/kvd --shell /usr/sbin/nologin kvd
COPY --from=build /out/kvd /usr/local/bin/kvd
COPY --from=build /out/default.gguf /usr/share/kvd/default.gguf
COPY deploy/docker/kvd.conf /etc/kvd/kvd.conf
USER kvd
EXPOSE 8080
VOLUME ["/models"]
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8080/health || exit 1
ENTRYPOINT ["/usr/local/bin/kvd", "serve"]
CMD ["--config", "/etc/kvd/kvd.conf"]
