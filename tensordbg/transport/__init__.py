"""How requests and replies cross between the training and the UI: wire types, signing, sockets."""
