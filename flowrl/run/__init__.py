"""The run machinery every trainer shares: a run's driver, loop, engine, update scheduler and folder.

`driver.Trainer` assembles a run and `run_loop.RunLoop` runs its epochs; `engine` (with `sharding`: FSDP2, ZeRO)
owns the device, the optimizers and the gradient steps; `scheduler` cuts an epoch's batch into inner epochs, mini-
and micro-batches; `algorithm.Algorithm` is what an algorithm is to the loop and `registry` names the algorithms
(`flowrl.trainers` holds them and registers them when imported). `async_rollouts`, `rollout_worker`,
`inline_rollouts`, `wire`, `learner_group` and `local_ray` are the asynchronous mode; `inference` loads a trained
run without a trainer; `update_batch` (the update's batch records), `run_folder`, `state`, `stats`, `artifacts`,
`advantages`, `ess` and `grad_probe` are the pieces they share.
Nothing here imports an algorithm: code that needs one is handed it (a rollout worker gets its run's config class).
"""
