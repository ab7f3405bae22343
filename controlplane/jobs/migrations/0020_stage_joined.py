from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0019_job_replica_sync'),
    ]

    operations = [
        migrations.AddField(
            model_name='stage',
            name='joined',
            field=models.JSONField(blank=True, help_text="A joining replica's copy of its stage's state from a live replica: from_replica, size_bytes, sha256, state_sha256.", null=True),
        ),
    ]
