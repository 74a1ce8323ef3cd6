"""The load session: opening a checkpoint (:mod:`gpuckpt.load.open`), checking its chunk files
and reading them into the caller's arrays."""
