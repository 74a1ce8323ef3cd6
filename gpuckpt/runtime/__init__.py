"""What every pipeline runs on: gpuckpt's own worker threads (:mod:`~gpuckpt.runtime.workers`),
the parallel jobs of one run (:mod:`~gpuckpt.runtime.runner`) and the paused garbage collector
(:mod:`~gpuckpt.runtime.collector`). Below storage, device and the sessions; above the format."""
