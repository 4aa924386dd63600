"""The pipeline schedules, in one place: each runs the model's layer stack cut over the ``pipeline`` mesh axis.

- ``fill_drain.py``: the circular fill-drain schedule (``Schedule``: a stack runner, differentiated by jax), the
  rows' split into microbatches, the bubble;
- ``one_f_one_b.py``: the 1F1B and interleaved schedules (``OneFOneB``): each stage's backward in the one loop, the
  loss inside it, its steps named;
- ``stack_cut.py``: the train step's model cut at its layer stack, for schedules that run the stack themselves;
- ``replicas.py``: a step's rows per replica, so that the weight gradients are summed over the replicas once a step.

Where a schedule stores the stack's periods (``jaxtron/parallel/stages.py``) and when each stage runs which unit
(``jaxtron/parallel/timetable.py``) live in ``parallel/``, below: checkpoints and the profile's bubble read them
too."""
