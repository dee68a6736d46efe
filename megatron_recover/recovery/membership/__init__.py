"""Between iterations: membership. A standby replica's join (`standby.py`: the pool of idle
standbys, their call-up and assembly into the cross-replica groups) and the transfer of a
training state over a ulfm group (`transfer.py`), which a join and a snapshot's hand-over use."""
