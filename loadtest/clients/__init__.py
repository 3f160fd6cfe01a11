"""Load generators: simulated browsers and bots, the publisher, attackers."""
