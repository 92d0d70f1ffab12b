"""What every layer stands on, and nothing of test-time adaptation: errors and their exit
codes, the bounds of a number a user writes, files read and written safely, the device,
interrupts, code a user names on the command line, and the environment a result records."""
