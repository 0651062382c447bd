"""When workers fail: the driver's watch over them (`watch`, asking their status with `probing`,
naming a death, stall or failure with `failure_messages`), and the faults a test injects into a
worker (`faults`).

May import: `launch` (a rank's place on the cluster, to name it).
"""
