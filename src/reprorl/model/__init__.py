"""The model parts every trainer uses: roles (actor, critic, reward model) with explicit LoRA,
encoding and chat templates, and the loss formulas as pure tensor functions."""
