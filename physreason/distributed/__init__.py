"""Disaggregated asynchronous GRPO on Ray: a controller, policy ranks and rollout replicas (see controller.py)."""
