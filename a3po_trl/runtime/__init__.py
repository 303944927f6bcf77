"""What both threads stand on: devices with an explicit index, copies and stream fences (:mod:`.devices`), device
work timed by events and read when logged (:mod:`.timing`), and the process group's teardown and agreements
(:mod:`.distributed`); what the generation thread is doing, for the error of a process that stops arriving
(:mod:`.activity`)."""
