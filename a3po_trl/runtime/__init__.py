"""What both threads stand on: devices with an explicit index, copies and stream fences (:mod:`.devices`), device
work timed by events and read when logged (:mod:`.timing`), and the process group's teardown and agreements
(:mod:`.distributed`)."""
