"""Roles while serving: telling an instance to take another role (``pdserve role``), and the planner
that decides which roles the instances should have (``pdserve plan``, ``pdserve up --autoscale``)."""
