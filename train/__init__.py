"""megasweep's trainer (`python -m train`) and the torch-free arithmetic it shares.

Importing this package must not import torch: the modules `sizes`, `flops`, `memory`,
`shapes`, `validation` and `planner` are pure arithmetic that the launcher and the
analysis use on machines without torch. Only the trainer's own modules import torch.
"""
