"""The config layer: how conf/ is read and checked before anything runs.

- `loader`: Hydra's search path, composing conf/ (CLI and API alike), the checks before Hydra,
  and a run's identity (`run_id`, `identity`).
- `validate`, `schema`: the checks of overrides and of the trainer's typed options, and the lists
  of valid values the config layer owns.
- `trust`: what a config may build; `offline`: what it may not fetch.
- `groups`: the config groups (`memtrain --help`, the usage page's table).
- `resolvers`, `sweeper`: memtrain's OmegaConf resolvers and the variants sweeper's expansion.

It imports nothing of the run, the measurement or the data but the job checks
(`memtrain.preflight`) the loader runs before Hydra starts a job.
"""
