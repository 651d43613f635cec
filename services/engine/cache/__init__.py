"""The expert cache: every (layer, expert) pair in a host store, a slot pool on the device holding
some of them, and the lookup that routes each routed expert to its slot (hit) or the host (miss)."""
