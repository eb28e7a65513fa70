"""lorafleet worker's dev tools (not shipped in the worker image): `tiny` (tiny models and PEFT adapters),
`launch` (worker processes for tests, demos and benchmarks), `demo` (the single-worker demo), `cli`
(`lorafleet-dev make-tiny-model | make-tiny-adapter`)."""
