"""Deployment: the topology file (one source of truth for roles, replicas, ports, model,
dtype and transport) and `tessera up`, which runs a topology as local processes."""
