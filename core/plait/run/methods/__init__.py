"""Training methods: what one optimizer step trains on and how its loss is made (``base.TrainingMethod``).

Language modelling and SFT are one method, next-token prediction (``next_token``): they differ in their data
only (SFT's blocks carry masked labels). Preference training is ``dpo`` (DPO and its family, TRL's definitions).
A new method is a new module here and a row of ``table.METHODS``, which ``plait train --method`` chooses from.
"""
