"""M2N transport for attention-FFN disaggregation: tagged tensor messages from M senders to N
receivers (dispatch) and back (combine). base.py has the interface and the slot mailbox,
local.py the in-process twin, tcp.py sockets between processes."""
