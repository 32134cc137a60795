"""The driver: the one process that sees the whole run, and the only code that knows Ray.

    loop.py             main, run (the algorithm, step after step), train_step (one step's update)
    schedule.py         RolloutSchedule (which rollout a step trains on, when it runs), Evaluation
    preflight.py        what a user can get wrong, checked before anything starts
    startup.py          the model, Ray, the placement, the trainer groups and the engines
    session.py          the Ray session, signals, and the shutdown every exit path runs
    placement.py        the placement group, each actor's place and CPU threads
    remote.py           gather (waits on remote calls) and the errors that mean a process died
    trainer_groups.py   TrainerGroup (one model's ranks), PolicyGroup, CriticGroup, Models
    rank_actor.py       RankActor: one trainer rank (train.worker.TrainWorker) as an actor
    rollout_manager.py  Rollouts: the engines, the prompt stream, weight sync, evaluation
    rollout_actor.py    RolloutActor: one vLLM engine (rollout.engine) and the agent loop as an actor
    run_checkpoints.py  the run's checkpoints (every group's, the loop's, the rollouts in flight), resume
    report.py           progress lines, summary.json, the closing lines
    specs.py            the config as the workers and the math read it (RunSpecs), built once at start-up

Worker code (algos/, train/, rollout/, weights/) never imports it.
"""
