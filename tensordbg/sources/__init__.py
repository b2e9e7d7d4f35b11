"""What a UI can ask of a training: the Source contract and the sources that serve it."""
