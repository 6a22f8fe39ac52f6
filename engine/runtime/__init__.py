"""Running a loaded model: sessions, the paged KV cache, the decode runner and its CUDA graphs,
sampling, the streaming decode loop, routing traces."""
