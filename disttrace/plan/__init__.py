"""The planner: memory and traffic of a training layout on paper (ZeRO, Megatron, pipeline bubble).
No torch, no model built."""
