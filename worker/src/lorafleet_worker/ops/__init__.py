"""The worker's C++ extensions, Python side: `loader` builds and loads the libraries whose sources are in
`csrc/`; `cpu_attention` (decode attention and a decoder layer's small ops), `cpu_gemm` (base linears in
panels) and `cpu_lora` (grouped LoRA) wrap their functions."""
