"""The objective: what a batch's tokens are trained toward. The policy losses and GRPO advantages (``loss``), the
off-policy corrections of their importance weights (``corrections``), and the KL penalty to a frozen reference
(``kl``). Pure functions of tensors; the step (services/trainer/step.py) calls them."""
