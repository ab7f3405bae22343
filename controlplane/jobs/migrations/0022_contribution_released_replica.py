from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0021_stage_replica_share_speed'),
    ]

    operations = [
        migrations.AddField(
            model_name='stagecontribution',
            name='held_since',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='stagecontribution',
            name='released_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
