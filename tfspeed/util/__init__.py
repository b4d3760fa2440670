"""Shared plumbing with no TensorFlow in it: locks on directories, atomic files, system
facts, and the command-line helpers the commands share."""
