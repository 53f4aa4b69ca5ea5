"""What the example tasks share: the episode state machine and the training loop."""
