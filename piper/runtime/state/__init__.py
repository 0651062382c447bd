"""What a worker keeps between steps: a unit's flat buffers, ZeRO shards and gradients (`unit`,
`unit_gradients`, `flat_buffers`), its optimizer (`optimizers`), mixed precision and the loss
scale (`precision`), clipping by the global norm (`clip`), and checkpoints (`checkpoint`, and
`checkpoint_files`, which reads them without running code).

May import: `launch`, `communication`.
"""
