"""Small helpers shared by the network layers."""
