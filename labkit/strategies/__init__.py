"""Reference hand-written parallel training strategies (the labs' solutions): ddp, zero, fsdp."""
