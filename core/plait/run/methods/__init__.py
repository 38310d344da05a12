"""Training methods: what one optimizer step trains on and how its loss is made (``base.TrainingMethod``).

Language modelling and SFT are one method, next-token prediction (``next_token``): they differ in their data
only (SFT's blocks carry masked labels). A new method (preference training, distillation) is a new module here.
"""
