"""lorafleet's development cluster (not shipped): what the tests, `make demo` and the benchmarks run on.

Modules: `cluster` (etcd + kube-apiserver + kube-controller-manager on loopback), `nodeagent`
(binds and runs pods), `images` (image -> local program), `podspec` (volumes, env), `kube` (a small
JSON client), `certs`, `session` (the shared cluster handed to tests and the demo), `hfhub` (a local
Hugging Face Hub), `minio` (a real MinIO server), `helm` and `stack` (the chart installed as a release).
CLI: `lorafleet-devcluster up|down|status|images` (see `cli`).
"""
