"""The stage framework: the contract a stage declares (``stage``), the one lifecycle that runs any
stage (``runner``), shards and resume (``shards``), counts and checks (``accounting``), fan-out over a work pool
(``fanout``), the run context, reporting and run summaries. It knows no pipeline: the stages
live in ``tasks/<pipeline>/``, one module each, over the logic in ``rde/<pipeline>/``."""
