"""The driver: the one process that sees the whole run, and the only code that knows Ray.

    loop.py             main, run (the algorithm, step after step), train_step (one step's update)
    schedule.py         RolloutSchedule (which rollout a step trains on, when it runs), Evaluation
    contracts.py        what the schedule and the step loop ask of the models, engines and checkpoints
    preflight.py        what a user can get wrong, checked before anything starts
    startup.py          the model, Ray, the placement, the trainer groups and the engines
    session.py          the Ray session, signals, and the shutdown every exit path runs
    placement.py        the placement group, each actor's place and CPU threads
    remote.py           gather (waits on remote calls) and the errors that mean a process died
    trainer_groups.py   TrainerGroup (one model's ranks: shards and gathers), PolicyGroup, CriticGroup, Models
    updates.py          a step's updates over a group: epochs x minibatches, the anchor, batch masks
    rank_actor.py       RankActor: one trainer rank (train.worker.TrainWorker); runs in a process of its own
    rollout_manager.py  Rollouts: the engines, a step's prompts over them, weight sync, evaluation
    prompts.py          the prompt stream and the held-out prompts
    rollout_actor.py    RolloutActor: one vLLM engine and the agent loop; runs in a process of its own
    run_checkpoints.py  the run's checkpoints (every group's, the loop's, the rollouts in flight), resume
    report.py           progress lines, summary.json, the closing lines
    specs.py            the config as the workers and the math read it (RunSpecs), built once at start-up

Worker code (algos/, train/, rollout/, weights/) never imports it.
"""
