"""Built-in tasks: prompt sets with labels and rule-based rewards, generated offline."""
