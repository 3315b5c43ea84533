"""The book's shared package: plumbing every script uses, and the mechanisms a later chapter builds on.

Plumbing: `launch` (one launcher for spawn and torchrun), `cli` (the script contract), `report`, `plot`, `trace`,
`bench`, `comm_log` (every collective the parallel layers run), `exercises` and `loader` (the checker), and the tiny
GPT with its data and checkpoints (`model`, `data`, `train`, `weights`).
Mechanisms, each written once by the chapter that teaches it and reused after: `collectives` (ch. 3), `ddp` and
`memory` (ch. 5), `tensor_parallel` (ch. 6), `pipeline` and `mesh` (ch. 7), the inference engine `engine/` and its
`server` (ch. 8-10), `kv_memory` (ch. 9), `speculative` and `json_constrained` (ch. 11), `rl` (ch. 12), `rlhf` (ch.
13), `weight_sync`, `rlhf_shards` (each role's work) and `ray_rlhf` (the roles as Ray actors) (ch. 14).
Communication stays apart from computation: a layer does not call a collective that its communication module does
not name.

Import the submodules directly (`from mlsys import cli, launch`), so that `--help` stays fast and nothing heavy is
imported by accident.
"""

__version__ = "0.1.0"
