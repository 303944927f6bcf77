"""What the trainer logs, in the two moments that produce metrics, one module each: :mod:`.batch` when a scored batch
enters the trainer, :mod:`.loss` when a micro-batch enters the loss."""
