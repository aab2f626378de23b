"""The pipeline's library: configuration, data, models, training, rollouts, evaluation and
serving, with no orchestration of its own (flows/ and tasks/ hold that). Importing it changes
no other library's behaviour: the few patches it makes are listed in `rlhf_core.patches`."""
