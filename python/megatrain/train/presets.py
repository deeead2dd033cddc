"""Built-in presets of ``megatrain train`` (data only; :func:`megatrain.train.config_build.preset_dict` merges one
over the defaults).

``default`` is the run that needs nothing downloaded: a 4-layer, 3.1M-parameter Llama-architecture
model trained for 200 steps on the Python standard library's own ``*.py`` sources with the byte
tokenizer (256 bytes + EOS). On a 2-core CPU it takes about 3 minutes (~0.75 s/step) and the
held-out loss falls from ~5.87 (ln 320 = 5.77 is uniform over the padded vocabulary) to ~2.4;
on a GPU it is the same run in bf16 (seconds).

``gpu`` is a bigger run for a GPU (a 12-layer, 76M-parameter model, 16 x 1024 tokens per step),
still on the standard library with the byte tokenizer; pick it with ``--preset gpu``.

``1b`` is the run that shows what megatrain is for: a 1.04B-parameter, 22-layer Llama (TinyLlama's
shape) whose layers are streamed from host memory, 4 x 2048 tokens per step for 200 steps
(``examples/configs/h200_1b.yaml`` written out). On one H200 it trains in about 100 s (467 ms/step)
with 1.9 GiB of GPU memory and 18 bytes of host memory per parameter (~19 GB; 22 GB process RSS);
it needs a GPU.
"""

PRESETS = {
    "default": {},
    "gpu": {
        "model": {
            "hidden_size": 768,
            "num_layers": 12,
            "num_heads": 12,
            "num_kv_heads": 4,
            "intermediate_size": 2048,
            "max_position_embeddings": 2048,
        },
        "data": {"seq_len": 1024},
        "train": {"steps": 300, "micro_batch_size": 16, "lr": 1.0e-3, "warmup_steps": 30},
        "eval": {"every": 100, "batches": 8},
    },
    "1b": {
        "model": {
            "hidden_size": 2048,
            "num_layers": 22,
            "num_heads": 16,
            "num_kv_heads": 8,
            "intermediate_size": 5632,
            "max_position_embeddings": 2048,
        },
        "data": {"seq_len": 2048},
        "train": {"steps": 200, "micro_batch_size": 4, "lr": 3.0e-4, "warmup_steps": 20, "max_grad_norm": 1.0},
        "runtime": {"compute_dtype": "bf16"},
        "eval": {"every": 100, "batches": 2},
        "log": {"every": 10},
    },
}
