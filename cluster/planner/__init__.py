"""The capacity planner: the demand file, one replica's physics, the plan and its table."""
